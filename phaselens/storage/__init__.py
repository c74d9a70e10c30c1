"""Files phaselens reads and writes: atomic writes, in-place updates, ownership (the manifest), result journals,
checksums, fingerprints and readers. Knows the contract, never a concrete model or analysis."""
