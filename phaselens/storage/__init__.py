"""Files phaselens reads and writes: atomic writes, ownership (the manifest), journals, checksums, fingerprints
and resumable results. Knows the contract, never a concrete model or analysis."""
