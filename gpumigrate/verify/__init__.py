"""`gpumigrate verify`: a migration proven on the user's own script by running it.

`runner` makes the scratch copies and the runs, `probe` instruments a run from the outside,
`shim` makes it short, offline and deterministic, `checks` compares the runs. This package
runs torch (in the runs it starts); the rest of gpumigrate does not import it."""
