"""The `ksi` command line client; it never imports the daemon or litellm."""
