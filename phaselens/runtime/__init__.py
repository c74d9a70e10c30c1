"""The runtime layer: planning and pricing of runs, and the query engines' shared loop. Knows the contract, never a
concrete model or analysis."""
