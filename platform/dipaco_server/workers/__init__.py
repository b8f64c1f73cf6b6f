"""Workers: volunteer machines, their hashed tokens, and the enrollment tokens that admit them."""
