"""Generated from contracts/*.proto by scripts/gen_proto.py. Do not edit."""
