"""Serving: contract types, KV store, transfer, prefill, decode, router, gateway, backends."""
