"""The control API: a daemon's server (server.py), the stdlib-only client
the CLI and loaders use (client.py), the typed answers both read
(answers.py), and how both find the daemon of a path (mounts.py)."""
