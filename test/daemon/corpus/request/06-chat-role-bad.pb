


robotx