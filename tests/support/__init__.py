"""Test-only support: fakes of stores and peers, scripted stand-in services, builders."""
