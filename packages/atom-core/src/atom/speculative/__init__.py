"""Speculative decoding: a drafter proposes tokens, the target verifies them in one step.

config.py      what the user asks for, checked before any weight loads
mtp.py         the multi-token-prediction layers a checkpoint ships (DeepSeek-V3, GLM-4.5)
proposer.py    runs the drafter over a step's sequences
verifier.py    accepts drafts so that the output follows the target's distribution
"""
