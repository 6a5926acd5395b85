"
Rtenant-a