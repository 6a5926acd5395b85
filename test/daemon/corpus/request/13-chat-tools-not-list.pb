


userHi{"a":1}