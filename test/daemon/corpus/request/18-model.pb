"
J	tiny-step