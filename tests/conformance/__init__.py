"""Conformance tests: the kit of tiercache.testing.conformance run against every backend we ship."""
