'


userHi*{"enable_thinking":false}