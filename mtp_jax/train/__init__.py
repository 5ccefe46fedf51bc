"""Training tools for test fixtures: trained targets, synthetic data, the MTP head."""
