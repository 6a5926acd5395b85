


userHiextreme