"""`meshtrain dashboard`: the grid's view in a browser. The JSON its page polls (the shape of
`meshtrain status --json`, each cell with a state, plus the loss curves) comes from a run
directory (rundir.py) or, through cli/dashboard.py, from the DHT; server.py serves it with
page.html."""
