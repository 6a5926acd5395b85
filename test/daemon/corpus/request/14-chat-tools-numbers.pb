


userHi[1,2]