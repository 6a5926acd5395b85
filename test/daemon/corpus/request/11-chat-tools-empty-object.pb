


userHi[{}]