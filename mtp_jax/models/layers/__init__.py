"""Building blocks shared by the model families: norms, rotary, attention, Gated DeltaNet, MLPs."""
