"""raas inside other RL trainers, each through the trainer's own extension point (selected by its
configuration): verl's agent loop, SkyRL's generator, AReaL's rollout workflow. Every module here is a
client of raas's HTTP API, like :mod:`raas.trainer`; each imports its trainer only when used."""
