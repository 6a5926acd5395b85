9


userHi+[{"type":"function","function":{"name":5}}]