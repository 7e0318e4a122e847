"""One module per event namespace; each service registers its handlers when asked to."""
