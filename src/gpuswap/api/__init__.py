"""The daemon's HTTP API and the client the CLI uses."""
