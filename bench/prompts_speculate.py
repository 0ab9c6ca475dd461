"""Prompts for `python -m bench speculate`: copy-heavy tasks, whose answers copy long
spans of the prompt, and free-form ones, whose answers copy little."""

PASSAGE = (
    "The Harbor Street library opened on 12 March 1921 with four thousand books and one "
    "reading room. In 1958 a fire destroyed the east wing, and the collection was moved "
    "to the old post office for two years. The new building, designed by Clara Mendes, "
    "opened on 3 June 1961 and still stands today. It now holds more than ninety thousand "
    "books, a map room and a small museum of the town's fishing fleet."
)

TYPOS = (
    "Teh quick brown fox jumpd over the lazy dog. It was a brigt cold day in Aprill, and "
    "the clocks were striking thirteen. Evry morning the baker opend his shop at six and "
    "sold bread to the fishermen before they went out to see."
)

RECIPE = (
    "Ingredients: 2 cups of flour, 1 cup of sugar, 3 eggs, 1 cup of milk, 1 teaspoon of "
    "baking powder, a pinch of salt. Steps: mix the flour, sugar, baking powder and salt. "
    "Beat the eggs with the milk. Pour the wet mixture into the dry one and stir until "
    "smooth. Bake for 30 minutes at 180 degrees."
)

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n"
)

COPY = [
    f"Fix the typos in this text and write out the corrected text in full:\n\n{TYPOS}",
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Extract every sentence that contains a year from this text, copied exactly:\n\n{PASSAGE}",
    f"Summarise this text in one sentence, then quote its first two sentences exactly:\n\n{PASSAGE}",
    f"Rewrite this recipe as a numbered list of steps, keeping the wording:\n\n{RECIPE}",
    f"Copy this Python code and add a docstring to each function:\n\n{CODE}",
    f"List the ingredients from this recipe, one per line, exactly as written:\n\n{RECIPE}",
    f"Correct the spelling in this paragraph and return the whole paragraph:\n\n{TYPOS}",
]

FREE = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain how photosynthesis works to a ten-year-old.",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "What are the main causes of the French Revolution?",
    "Describe your ideal weekend in a few sentences.",
    "Write a poem about the ocean at night.",
    "How do I make a good cup of coffee?",
    "Explain the difference between a virus and a bacterium.",
]
