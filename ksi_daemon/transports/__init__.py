"""Front doors: each translates its frames into events for the router and back, and knows no service."""
