"""Tests of the standalone cache server (tiercache/server) and its client tier."""
