"""Discrete-event simulation of colocated vs disaggregated serving."""
