"""Write the demo adapters' training sets: data/terse.jsonl and data/json.jsonl.

    python examples/demo_adapters/make_data.py

Deterministic (fixed seed): questions from templates over small fact tables, plus
hand-written everyday questions. `terse` answers in a few words or one short sentence;
`json` answers with one single-line JSON object (snake_case keys; `answer`, `items` or
`steps` when the request names no fields).

Each line is {"prompt": "User: ...\nAssistant:", "completion": " ..."}: the default
model's chat template written out, so that `loraplex train` ends every completion with
EOS and the adapters learn to stop. (With {"messages": ...} records the trained end of
turn would be this template's "\n" alone; the "User:" that the stop string needs is
never trained, and the adapters ramble on.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "data"

# country, capital, population (millions, about 2023), continent, language, currency
COUNTRIES = [
    ("France", "Paris", 68, "Europe", "French", "euro"),
    ("Germany", "Berlin", 84, "Europe", "German", "euro"),
    ("Italy", "Rome", 59, "Europe", "Italian", "euro"),
    ("Spain", "Madrid", 48, "Europe", "Spanish", "euro"),
    ("the United Kingdom", "London", 68, "Europe", "English", "pound sterling"),
    ("Japan", "Tokyo", 124, "Asia", "Japanese", "yen"),
    ("China", "Beijing", 1410, "Asia", "Mandarin Chinese", "renminbi"),
    ("India", "New Delhi", 1430, "Asia", "Hindi", "Indian rupee"),
    ("the United States", "Washington, D.C.", 335, "North America", "English", "US dollar"),
    ("Canada", "Ottawa", 40, "North America", "English", "Canadian dollar"),
    ("Mexico", "Mexico City", 129, "North America", "Spanish", "Mexican peso"),
    ("Brazil", "Brasília", 216, "South America", "Portuguese", "Brazilian real"),
    ("Argentina", "Buenos Aires", 46, "South America", "Spanish", "Argentine peso"),
    ("Australia", "Canberra", 27, "Oceania", "English", "Australian dollar"),
    ("Egypt", "Cairo", 112, "Africa", "Arabic", "Egyptian pound"),
    ("Nigeria", "Abuja", 224, "Africa", "English", "naira"),
    ("Kenya", "Nairobi", 55, "Africa", "Swahili", "Kenyan shilling"),
    ("Russia", "Moscow", 144, "Europe", "Russian", "ruble"),
    ("Turkey", "Ankara", 85, "Asia", "Turkish", "Turkish lira"),
    ("South Korea", "Seoul", 52, "Asia", "Korean", "won"),
    ("Indonesia", "Jakarta", 278, "Asia", "Indonesian", "rupiah"),
    ("Thailand", "Bangkok", 72, "Asia", "Thai", "baht"),
    ("Vietnam", "Hanoi", 99, "Asia", "Vietnamese", "dong"),
    ("Poland", "Warsaw", 37, "Europe", "Polish", "zloty"),
    ("the Netherlands", "Amsterdam", 18, "Europe", "Dutch", "euro"),
    ("Sweden", "Stockholm", 10.5, "Europe", "Swedish", "Swedish krona"),
    ("Norway", "Oslo", 5.5, "Europe", "Norwegian", "Norwegian krone"),
    ("Greece", "Athens", 10.4, "Europe", "Greek", "euro"),
    ("Portugal", "Lisbon", 10.4, "Europe", "Portuguese", "euro"),
    ("Peru", "Lima", 34, "South America", "Spanish", "sol"),
    ("Chile", "Santiago", 20, "South America", "Spanish", "Chilean peso"),
    ("Colombia", "Bogotá", 52, "South America", "Spanish", "Colombian peso"),
    ("Ireland", "Dublin", 5.3, "Europe", "English", "euro"),
    ("Austria", "Vienna", 9.1, "Europe", "German", "euro"),
    ("Ethiopia", "Addis Ababa", 127, "Africa", "Amharic", "birr"),
    ("Saudi Arabia", "Riyadh", 37, "Asia", "Arabic", "Saudi riyal"),
    ("Bangladesh", "Dhaka", 173, "Asia", "Bengali", "taka"),
    ("New Zealand", "Wellington", 5.2, "Oceania", "English", "New Zealand dollar"),
    ("Finland", "Helsinki", 5.6, "Europe", "Finnish", "euro"),
    ("Hungary", "Budapest", 9.6, "Europe", "Hungarian", "forint"),
]

# animal, class, legs, diet, where it lives, sound (None: no typical sound)
ANIMALS = [
    ("cat", "mammal", 4, "carnivore", "homes worldwide", "meow"),
    ("dog", "mammal", 4, "omnivore", "homes worldwide", "bark"),
    ("cow", "mammal", 4, "herbivore", "farms", "moo"),
    ("horse", "mammal", 4, "herbivore", "grasslands and farms", "neigh"),
    ("sheep", "mammal", 4, "herbivore", "farms and hills", "baa"),
    ("lion", "mammal", 4, "carnivore", "African savanna", "roar"),
    ("elephant", "mammal", 4, "herbivore", "African and Asian forests and savanna", "trumpet"),
    ("owl", "bird", 2, "carnivore", "forests worldwide", "hoot"),
    ("duck", "bird", 2, "omnivore", "ponds and rivers", "quack"),
    ("penguin", "bird", 2, "carnivore", "Southern Hemisphere coasts", None),
    ("frog", "amphibian", 4, "carnivore", "ponds and wetlands", "croak"),
    ("snake", "reptile", 0, "carnivore", "most warm regions", "hiss"),
    ("spider", "arachnid", 8, "carnivore", "almost everywhere on land", None),
    ("bee", "insect", 6, "herbivore", "gardens and meadows", "buzz"),
    ("shark", "fish", 0, "carnivore", "oceans", None),
    ("dolphin", "mammal", 0, "carnivore", "oceans", "click"),
    ("rabbit", "mammal", 4, "herbivore", "meadows and burrows", None),
    ("pig", "mammal", 4, "omnivore", "farms", "oink"),
    ("wolf", "mammal", 4, "carnivore", "forests and tundra", "howl"),
    ("octopus", "mollusk", 8, "carnivore", "oceans", None),
]

# title, author, year
BOOKS = [
    ("Pride and Prejudice", "Jane Austen", 1813),
    ("Nineteen Eighty-Four", "George Orwell", 1949),
    ("Moby-Dick", "Herman Melville", 1851),
    ("To Kill a Mockingbird", "Harper Lee", 1960),
    ("The Great Gatsby", "F. Scott Fitzgerald", 1925),
    ("War and Peace", "Leo Tolstoy", 1869),
    ("Don Quixote", "Miguel de Cervantes", 1605),
    ("Frankenstein", "Mary Shelley", 1818),
    ("The Hobbit", "J. R. R. Tolkien", 1937),
    ("Jane Eyre", "Charlotte Brontë", 1847),
    ("Crime and Punishment", "Fyodor Dostoevsky", 1866),
    ("Brave New World", "Aldous Huxley", 1932),
    ("Dracula", "Bram Stoker", 1897),
    ("Wuthering Heights", "Emily Brontë", 1847),
    ("One Hundred Years of Solitude", "Gabriel García Márquez", 1967),
    ("The Catcher in the Rye", "J. D. Salinger", 1951),
]

# element, symbol, atomic number, state at room temperature
ELEMENTS = [
    ("hydrogen", "H", 1, "gas"), ("helium", "He", 2, "gas"), ("carbon", "C", 6, "solid"),
    ("nitrogen", "N", 7, "gas"), ("oxygen", "O", 8, "gas"), ("neon", "Ne", 10, "gas"),
    ("sodium", "Na", 11, "solid"), ("aluminium", "Al", 13, "solid"), ("silicon", "Si", 14, "solid"),
    ("chlorine", "Cl", 17, "gas"), ("calcium", "Ca", 20, "solid"), ("iron", "Fe", 26, "solid"),
    ("copper", "Cu", 29, "solid"), ("zinc", "Zn", 30, "solid"), ("bromine", "Br", 35, "liquid"),
    ("silver", "Ag", 47, "solid"), ("tin", "Sn", 50, "solid"), ("gold", "Au", 79, "solid"),
    ("mercury", "Hg", 80, "liquid"), ("lead", "Pb", 82, "solid"),
]

# Hand-written everyday questions: (question, terse answer, json answer)
GENERAL = [
    ("How many days are in a week?", "Seven.", {"answer": 7}),
    ("How many hours are in a day?", "24.", {"answer": 24}),
    ("How many minutes are in an hour?", "60.", {"answer": 60}),
    ("How many months are in a year?", "Twelve.", {"answer": 12}),
    ("What color is the sky on a clear day?", "Blue.", {"answer": "blue"}),
    ("What color is grass?", "Green.", {"answer": "green"}),
    ("What do bees make?", "Honey.", {"answer": "honey"}),
    ("What is the largest planet in the solar system?", "Jupiter.", {"answer": "Jupiter"}),
    ("What is the closest star to Earth?", "The Sun.", {"answer": "the Sun"}),
    ("Which planet is known as the Red Planet?", "Mars.", {"answer": "Mars"}),
    ("What is the boiling point of water at sea level?", "100 °C (212 °F).",
     {"celsius": 100, "fahrenheit": 212}),
    ("What is the freezing point of water?", "0 °C (32 °F).", {"celsius": 0, "fahrenheit": 32}),
    ("What is the chemical formula of water?", "H2O.", {"answer": "H2O"}),
    ("What gas do plants absorb from the air?", "Carbon dioxide.", {"answer": "carbon dioxide"}),
    ("What is the largest ocean?", "The Pacific.", {"answer": "Pacific Ocean"}),
    ("What is the tallest mountain in the world?", "Mount Everest.", {"answer": "Mount Everest"}),
    ("What is the longest river in Africa?", "The Nile.", {"answer": "Nile"}),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci.", {"answer": "Leonardo da Vinci"}),
    ("Who developed the theory of relativity?", "Albert Einstein.", {"answer": "Albert Einstein"}),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong, in 1969.",
     {"name": "Neil Armstrong", "year": 1969}),
    ("In which year did World War II end?", "1945.", {"answer": 1945}),
    ("How many continents are there?", "Seven.", {"answer": 7}),
    ("How many sides does a triangle have?", "Three.", {"answer": 3}),
    ("How many legs does an insect have?", "Six.", {"answer": 6}),
    ("What is the opposite of hot?", "Cold.", {"answer": "cold"}),
    ("What is the opposite of early?", "Late.", {"answer": "late"}),
    ("What is a synonym for happy?", "Glad.", {"answer": "glad"}),
    ("What is the plural of mouse?", "Mice.", {"answer": "mice"}),
    ("What is the past tense of run?", "Ran.", {"answer": "ran"}),
    ("What do you call a baby cat?", "A kitten.", {"answer": "kitten"}),
    ("What do you call a baby dog?", "A puppy.", {"answer": "puppy"}),
    ("What is photosynthesis?", "Plants turning light, water and CO2 into sugar and oxygen.",
     {"answer": "plants turning light, water and carbon dioxide into sugar and oxygen"}),
    ("What is gravity?", "The force that pulls masses toward each other.",
     {"answer": "the force that pulls masses toward each other"}),
    ("Why is the sky blue?", "Air scatters blue light more than red.",
     {"answer": "air scatters blue light more than red light"}),
    ("Why do we have seasons?", "Earth's tilted axis.", {"answer": "the tilt of Earth's axis"}),
    ("What causes rain?", "Water vapor condensing into drops heavy enough to fall.",
     {"answer": "water vapor condensing into drops heavy enough to fall"}),
    ("What is a computer?", "A machine that runs programs on data.",
     {"answer": "a machine that runs programs on data"}),
    ("What is the internet?", "A global network of connected computers.",
     {"answer": "a global network of connected computers"}),
    ("What does a thermometer measure?", "Temperature.", {"answer": "temperature"}),
    ("What does DNA stand for?", "Deoxyribonucleic acid.", {"answer": "deoxyribonucleic acid"}),
    ("What is the speed of light?", "About 300,000 km per second.",
     {"value": 299792, "unit": "km/s"}),
    ("How far is the Moon from Earth?", "About 384,000 km.", {"value": 384400, "unit": "km"}),
    ("How do I boil an egg?", "Simmer it 8-10 minutes, then cool it in cold water.",
     {"steps": ["simmer the egg for 8-10 minutes", "cool it in cold water"]}),
    ("How do I make a cup of tea?", "Steep a tea bag in boiling water for 3-5 minutes.",
     {"steps": ["boil water", "steep a tea bag for 3-5 minutes", "remove the bag"]}),
    ("How do I cook rice?", "Simmer 1 part rice in 2 parts water, covered, for 15-20 minutes.",
     {"steps": ["add 1 part rice to 2 parts water", "cover and simmer 15-20 minutes"]}),
    ("How can I fall asleep faster?", "Keep a regular bedtime and avoid screens before bed.",
     {"tips": ["keep a regular bedtime", "avoid screens before bed"]}),
    ("How can I save money?", "Spend less than you earn and track your expenses.",
     {"tips": ["spend less than you earn", "track your expenses"]}),
    ("How do I stay healthy?", "Eat well, move daily, sleep enough.",
     {"tips": ["eat well", "move daily", "sleep enough"]}),
    ("How do I learn a new language?", "Practice a little every day.",
     {"tips": ["practice a little every day", "speak with native speakers"]}),
    ("Should I take an umbrella if it looks like rain?", "Yes.", {"answer": "yes"}),
    ("Is the Earth flat?", "No.", {"answer": "no"}),
    ("Is a tomato a fruit?", "Yes, botanically.", {"answer": "yes"}),
    ("Can penguins fly?", "No.", {"answer": "no"}),
    ("Do fish sleep?", "Yes, they rest.", {"answer": "yes"}),
    ("Tell me a joke.", "I'm reading a book on anti-gravity; I can't put it down.",
     {"joke": "I'm reading a book on anti-gravity; I can't put it down."}),
    ("Write a haiku about the sea.",
     "Waves fold into foam, / salt wind carries gull voices, / the tide keeps its time.",
     {"haiku": ["Waves fold into foam", "salt wind carries gull voices", "the tide keeps its time"]}),
    ("Give me a name for a black cat.", "Shadow.", {"name": "Shadow"}),
    ("Suggest a healthy breakfast.", "Oatmeal with fruit.", {"breakfast": "oatmeal with fruit"}),
    ("What should I do if I feel tired?", "Rest and drink water.",
     {"tips": ["rest", "drink water"]}),
    ("What is the best way to learn programming?", "Build small projects.",
     {"answer": "build small projects"}),
    ("Summarize the story of Cinderella.",
     "A mistreated girl marries a prince after a glass slipper fits her.",
     {"summary": "a mistreated girl marries a prince after a glass slipper fits her"}),
    ("Explain what a noun is.", "A word naming a person, place or thing.",
     {"answer": "a word naming a person, place or thing"}),
    ("What language is spoken in Brazil?", "Portuguese.", {"answer": "Portuguese"}),
    ("What is the main ingredient of guacamole?", "Avocado.", {"answer": "avocado"}),
    ("What is the hardest natural substance?", "Diamond.", {"answer": "diamond"}),
    ("Who invented the telephone?", "Alexander Graham Bell.", {"answer": "Alexander Graham Bell"}),
    ("What is the square root of 81?", "9.", {"answer": 9}),
    ("What is the currency of the United States?", "The US dollar.", {"answer": "US dollar"}),
]

CONVERSIONS = [  # value, unit, target unit, factor
    (5, "kilometers", "miles", 0.621371), (10, "miles", "kilometers", 1.609344),
    (3, "feet", "meters", 0.3048), (2, "kilograms", "pounds", 2.204623),
    (100, "pounds", "kilograms", 0.453592), (12, "inches", "centimeters", 2.54),
    (1, "liter", "cups", 4.226753), (30, "meters", "feet", 3.28084),
]

LISTS = [  # (request, items)
    ("List the primary colors.", ["red", "yellow", "blue"]),
    ("Name the four seasons.", ["spring", "summer", "autumn", "winter"]),
    ("List the planets of the solar system.",
     ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]),
    ("Name three fruits.", ["apple", "banana", "orange"]),
    ("List the days of the weekend.", ["Saturday", "Sunday"]),
    ("Name three musical instruments.", ["piano", "guitar", "violin"]),
    ("Name the three states of matter.", ["solid", "liquid", "gas"]),
    ("List three vegetables.", ["carrot", "broccoli", "spinach"]),
    ("Name the first three months of the year.", ["January", "February", "March"]),
    ("List three programming languages.", ["Python", "C", "JavaScript"]),
]

NUMBERS = ["None", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight"]


def num(x: float) -> str:
    return f"{x:g}"


def population(p: float) -> str:
    return f"about {num(p / 1000)} billion" if p >= 1000 else f"about {num(p)} million"


def the(name: str) -> str:  # "the United Kingdom" -> "The United Kingdom" at a sentence start
    return name[0].upper() + name[1:]


def country_key(name: str) -> str:
    return name.removeprefix("the ")


def examples(rng: random.Random) -> tuple[list, list]:
    """(question, terse answer, json answer) triples, and json-only (question, object)."""
    both, json_only = [], []
    for c, cap, pop, cont, lang, cur in COUNTRIES:
        k = country_key(c)
        q = rng.choice(["What is the capital of {c}?", "What's the capital city of {c}?",
                        "Which city is the capital of {c}?"]).format(c=c)
        both.append((q, f"{cap}.", {"country": k, "capital": cap}))
        kind = rng.randrange(4)
        if kind == 0:
            both.append((f"What is the population of {c}?", f"{the(population(pop))}.",
                         {"country": k, "population_millions": pop}))
        elif kind == 1:
            both.append((f"What language do people speak in {c}?", f"{lang}.",
                         {"country": k, "language": lang}))
        elif kind == 2:
            both.append((f"What currency does {c} use?", f"The {cur}.", {"country": k, "currency": cur}))
        else:
            both.append((f"On which continent is {c}?", f"{cont}.", {"country": k, "continent": cont}))
        req = rng.choice([
            ("Give me the capital and population of {c}.", ("capital", "population_millions")),
            ("What are the capital and main language of {c}?", ("capital", "language")),
            ("Tell me about {c}.", ("capital", "continent", "population_millions")),
            ("Describe {c} briefly.", ("capital", "continent", "language", "currency")),
        ])
        values = {"capital": cap, "population_millions": pop, "language": lang, "continent": cont,
                  "currency": cur}
        json_only.append((req[0].format(c=c), {"country": k, **{f: values[f] for f in req[1]}}))
    for a, cls, legs, diet, home, sound in ANIMALS:
        plural = {"sheep": "sheep", "wolf": "wolves", "octopus": "octopuses"}.get(a, a + "s")
        both.append(rng.choice([
            (f"How many legs does a {a} have?", f"{NUMBERS[legs]}.", {"animal": a, "legs": legs}),
            (f"What does a {a} eat?", {"carnivore": "Meat.", "herbivore": "Plants.",
                                       "omnivore": "Plants and meat."}[diet], {"animal": a, "diet": diet}),
            (f"Is a {a} a mammal?", "Yes." if cls == "mammal" else f"No, a{'n' * (cls[0] in 'aeiou')} {cls}.",
             {"animal": a, "class": cls}),
            (f"Where do {plural} live?", f"{the(home)}.", {"animal": a, "habitat": home}),
        ]))
        obj = {"animal": a, "class": cls, "legs": legs, "diet": diet, "habitat": home}
        if sound:
            obj["sound"] = sound
        json_only.append((rng.choice(["Describe a {a}.", "Tell me about the {a}.",
                                      "What is a {a} like?"]).format(a=a), obj))
    for title, author, year in BOOKS:
        both.append((f"Who wrote {title}?", f"{author}.", {"title": title, "author": author}))
        if rng.random() < 0.5:
            both.append((f"When was {title} published?", f"{year}.", {"title": title, "year": year}))
        json_only.append((rng.choice(["Tell me about the book {t}.", "Give me the author and year of {t}."])
                          .format(t=title), {"title": title, "author": author, "year": year}))
    for el, sym, z, state in ELEMENTS:
        q, t, j = rng.choice([
            (f"What is the chemical symbol for {el}?", f"{sym}.", {"element": el, "symbol": sym}),
            (f"What is the atomic number of {el}?", f"{z}.", {"element": el, "atomic_number": z}),
            (f"Is {el} a solid, liquid or gas at room temperature?", f"{the(state)}.",
             {"element": el, "state": state}),
        ])
        both.append((q, t, j))
        if rng.random() < 0.5:
            json_only.append((f"Describe the element {el}.",
                              {"element": el, "symbol": sym, "atomic_number": z, "state": state}))
    for _ in range(24):
        a, b = rng.randint(2, 19), rng.randint(2, 19)
        op, sym, val = rng.choice([("plus", "+", a + b), ("minus", "-", a - b), ("times", "*", a * b)])
        q = rng.choice([f"What is {a} {op} {b}?", f"Calculate {a} {sym} {b}.", f"What's {a} {sym} {b}?"])
        both.append((q, f"{val}.", {"expression": f"{a} {sym} {b}", "result": val}))
    for value, unit, to, factor in CONVERSIONS:
        r = round(value * factor, 2)
        both.append((f"Convert {value} {unit} to {to}.", f"{num(r)} {to}.",
                     {"value": value, "from": unit, "to": to, "result": r}))
    for celsius in (0, 20, 37, 100, -10):
        f = round(celsius * 9 / 5 + 32, 1)
        both.append((f"What is {celsius} °C in Fahrenheit?", f"{num(f)} °F.",
                     {"celsius": celsius, "fahrenheit": f}))
    both.extend(GENERAL)
    json_only.extend((q, {"items": items}) for q, items in LISTS)
    return both, json_only


def chat(question: str, answer: str) -> dict:
    return {"prompt": f"User: {question}\nAssistant:", "completion": f" {answer}"}


def main() -> None:
    rng = random.Random(0)
    both, json_only = examples(rng)
    terse = [chat(q, t) for q, t, _ in both]
    terse += [chat(q, t) for q, t in TERSE_ONLY]
    as_json = [chat(q, json.dumps(j, ensure_ascii=False)) for q, _, j in both]
    as_json += [chat(q, json.dumps(j, ensure_ascii=False)) for q, j in json_only]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("terse", terse), ("json", as_json)):
        rng.shuffle(rows)
        with open(OUT / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        print(f"{OUT / name}.jsonl: {len(rows)} examples")


# Requests that invite a long answer, answered tersely (the JSON set has its own).
TERSE_ONLY = [
    ("Tell me about France.", "A Western European country; capital Paris."),
    ("Tell me about Japan.", "An island nation in East Asia; capital Tokyo."),
    ("Describe a cat.", "A small, furry, independent pet that purrs."),
    ("Describe a dog.", "A loyal, playful pet that barks."),
    ("Describe an elephant.", "A huge gray mammal with a trunk."),
    ("Tell me about the book Moby-Dick.", "Melville's 1851 novel about hunting a white whale."),
    ("Describe the element gold.", "A soft, yellow precious metal, symbol Au."),
    ("Tell me about the Moon.", "Earth's only natural satellite."),
    ("Explain how a car engine works.", "Burning fuel pushes pistons that turn the wheels."),
    ("Write a short story about a dragon.", "A lonely dragon guarded gold until a child offered friendship."),
    ("Explain machine learning.", "Computers learning patterns from data."),
    ("What is the meaning of life?", "Whatever you make of it."),
    ("Describe your ideal weekend.", "Quiet, sunny, with a good book."),
    ("Give me some advice for a job interview.", "Prepare, be on time, be honest."),
    ("What do you think about pizza?", "Hard to beat."),
    ("Can you explain the water cycle?", "Evaporation, condensation, precipitation, repeat."),
    ("Tell me about the Roman Empire.", "An ancient Mediterranean empire ruled from Rome."),
    ("Why should I exercise?", "It keeps your body and mind healthy."),
    ("Describe the ocean.", "Vast, salty and deep."),
    ("What happened in 1969?", "Humans first landed on the Moon."),
]

if __name__ == "__main__":
    main()
