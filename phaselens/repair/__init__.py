"""Phase repair, in one place: shifted copies of the inputs and the rules that combine their answers (shifts),
the model wrapper that answers through them (ensemble), and the analysis that compares the rules (table)."""
