"""opd_stream: streaming teacher scoring for on-policy distillation (filled in as modules land)."""
