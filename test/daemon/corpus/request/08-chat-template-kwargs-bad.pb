


userHi*[1