"""Test tooling that ships with the agent: the reference job and the fault injectors.

``train`` is the small GPT on seeded synthetic data that the drill, the campaign,
the examples and the tests run under the guard (``python -m sdcguard.agent.testing.train``);
``inject`` is the ``SDCGUARD_INJECT`` fault injection the drill and the node checks use
(the guard and ``sdcguard replay`` honour it, and do nothing when it is unset). A
training job imports neither.
"""
