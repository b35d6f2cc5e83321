"""The general prompts a decoder store's retain set asks the base model to answer (edgetrain.personalise.retain).

What a personal adapter must not lose is what the model did before it: answer questions of general
knowledge, follow simple instructions, write, reason a little, chat. The prompts span those, in plain
English, short enough that a batch of all of them fits a phone's memory. They are fixed: a store records the
digest of what it was made from, so changing this list makes no existing store's retain set wrong.
An app passes its own with Personaliser(retain_prompts=[...]).
"""
from __future__ import annotations

GENERAL_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "How many days are there in a leap year?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level?",
    "Name three primary colours.",
    "What is the largest planet in our solar system?",
    "Why is the sky blue?",
    "What does a thermometer measure?",
    "Explain photosynthesis in one sentence.",
    "What is the difference between weather and climate?",
    "How does a vaccine help the body?",
    "What causes the seasons on Earth?",
    "What is 12 times 7?",
    "If I have 3 apples and eat one, how many are left?",
    "Is 17 a prime number? Explain briefly.",
    "Convert 2 kilometres to metres.",
    "Write a haiku about the sea.",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "Describe a sunrise in two sentences.",
    "Suggest a name for a friendly cat.",
    "Give me three tips for sleeping better.",
    "How do I boil an egg?",
    "What should I pack for a day at the beach?",
    "How can I make a cup of tea?",
    "Translate 'good morning' into Spanish.",
    "What is the opposite of 'ancient'?",
    "Use the word 'gentle' in a sentence.",
    "Summarise the story of Cinderella in two sentences.",
    "Hello! How are you today?",
    "Can you tell me a joke?",
    "What is a good way to start learning to program?",
    "What does a list do in Python?",
)
