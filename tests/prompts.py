"""Varied chat questions for tests against the default model."""

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Name three primary colors.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
    "List the first five prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in five words.",
    "What does CPU stand for?",
    "Suggest a name for a pet goldfish.",
    "How many days are in a leap year?",
    "What is the opposite of 'cold'?",
    "Write one sentence about the moon.",
    "What color is the sky on a clear day?",
    "Say hello in French.",
]
