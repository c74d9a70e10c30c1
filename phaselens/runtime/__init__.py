"""The runtime layer: files and ownership, checkpoints, fingerprints, distributed sharding, progress, planning,
replicas and the query engines' shared loop. Knows the contract, never a concrete model or analysis."""
