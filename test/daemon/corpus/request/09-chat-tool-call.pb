š

userweather?
B
	assistant
look it up")
c1functionget_weather"{"city":"x"}

toolsunny*c1®[{"type":"function","function":{"name":"get_weather","description":"the weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]