"""The edge: click commands, processes, exit codes."""
