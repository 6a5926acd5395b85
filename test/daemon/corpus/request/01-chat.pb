!

system	Be brief.


userHi