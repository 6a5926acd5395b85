x*j

jENDr