
	has space"
