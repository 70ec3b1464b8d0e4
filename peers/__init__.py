"""Talking to other islands: the hivemind DHT and a verified pseudo-gradient averager."""
