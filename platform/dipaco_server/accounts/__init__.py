"""Staff accounts of the admin API: personal bearer tokens, stored hashed."""
