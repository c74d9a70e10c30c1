"""phaselens' own compressed-cache transformer: config, compressor, attention, cache, query engine, files."""
