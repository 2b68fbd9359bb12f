"""Test helpers for `port fetch`: fake hubs on 127.0.0.1 and a runner for the CLI in child processes."""
