"""Fault injection: userspace TCP/UDP proxy, kernel shaping between namespaces, control API."""
