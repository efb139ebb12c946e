"""The Gyre scheduler: bursts, the execution ledger, the waterlevel, cell roles, transitions."""
