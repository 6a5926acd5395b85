


userHihigh