"""Hand-written topic lists and code snippets that the prompt builders combine.

Kept apart from the builders so the vocabulary can grow without touching the generation logic, and so a
reader can see at a glance what subject matter the draft head is distilled on. Everything here was
written for this project; nothing is taken from a public prompt dataset. Entries are short and concrete
on purpose: the embedded target is a 135M-parameter chat model, and the head only learns from answers the
target can actually give.
"""

from __future__ import annotations

# --- coding -------------------------------------------------------------------------------------------

# Phrased so they read after "a function that ..." in either language.
FUNCTION_TASKS = [
    "reverses a string without using slicing", "checks whether a string is a palindrome, ignoring case and spaces",
    "returns the n-th Fibonacci number iteratively", "counts how many vowels are in a string",
    "removes duplicates from a list while keeping the original order", "finds the second largest number in a list",
    "merges two sorted lists into one sorted list", "flattens a list of lists by one level",
    "returns the factorial of a non-negative integer", "checks whether a number is prime",
    "converts a temperature from Celsius to Fahrenheit", "counts word frequencies in a sentence",
    "capitalizes the first letter of every word in a sentence", "returns the sum of the digits of an integer",
    "finds the longest word in a sentence", "checks whether two strings are anagrams of each other",
    "splits a list into chunks of size k", "returns the greatest common divisor of two integers",
    "does a simple check that a string looks like an email address",
    "returns the average of a list, or None if it is empty",
    "rotates a list to the right by k positions", "returns the indices of two numbers that add up to a target",
    "converts a Roman numeral to an integer", "converts a positive integer to its binary representation",
    "returns true if a list is sorted in ascending order", "finds the most common element in a list",
    "truncates a string to n characters and adds '...' when it was cut", "transposes a matrix stored as nested lists",
    "keeps only the even numbers from a list", "groups a list of words by their first letter",
    "converts snake_case names to camelCase", "returns the running total of a list of numbers",
    "checks whether the brackets in a string are balanced", "returns the common items of two lists without duplicates",
    "formats a number of seconds as HH:MM:SS", "performs binary search on a sorted list",
    "counts how many times a substring appears in a string", "returns the three largest values in a list",
    "parses a query string like 'a=1&b=2' into a key-value mapping", "clamps a number between a minimum and a maximum",
    "checks whether a year is a leap year", "returns the initials of a full name",
]

FUNCTION_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}. Add one example call.",
    "How would I write a function in {lang} that {task}?",
    "Implement a {lang} function that {task}. Keep it under 15 lines.",
    "Show me a short {lang} function that {task}, with a comment on each step.",
    "Write a {lang} function that {task}, then state its time complexity in one sentence.",
    "I need a small {lang} helper that {task}. Show the code and one test case.",
    "Can you write {lang} code that {task}? Please keep it beginner-friendly.",
]

# (language, code) pairs to be explained; each is small enough to reason about without running it.
SNIPPETS = [
    ("Python", "nums = [3, 1, 4, 1, 5]\nprint(sorted(set(nums)))"),
    ("Python", "def f(s):\n    return s == s[::-1]"),
    ("Python", "squares = {n: n * n for n in range(5)}\nprint(squares)"),
    ("Python", "words = 'the cat sat'.split()\nprint(' '.join(w.upper() for w in words))"),
    ("Python", "total = 0\nfor i in range(1, 11):\n    if i % 2 == 0:\n        total += i\nprint(total)"),
    ("Python", "with open('data.txt') as fh:\n    lines = [l.strip() for l in fh if l.strip()]"),
    ("Python", "from collections import Counter\nprint(Counter('banana').most_common(1))"),
    ("Python", "def add(x, items=[]):\n    items.append(x)\n    return items"),
    ("Python", "pairs = list(zip(['a', 'b', 'c'], [1, 2, 3]))\nprint(dict(pairs))"),
    ("Python", "try:\n    value = int(text)\nexcept ValueError:\n    value = 0"),
    ("JavaScript", "const doubled = [1, 2, 3].map(x => x * 2);\nconsole.log(doubled);"),
    ("JavaScript", "const evens = nums.filter(n => n % 2 === 0);"),
    ("JavaScript", "const sum = [4, 5, 6].reduce((acc, n) => acc + n, 0);"),
    ("JavaScript", "console.log(0.1 + 0.2 === 0.3);"),
    ("JavaScript", "const user = { name: 'Ana', age: 31 };\nconst { name } = user;\nconsole.log(name);"),
    ("JavaScript", "setTimeout(() => console.log('later'), 0);\nconsole.log('now');"),
    ("JavaScript", "const unique = [...new Set(['a', 'b', 'a'])];"),
    ("SQL", "SELECT city, COUNT(*) AS n\nFROM customers\nGROUP BY city\nHAVING COUNT(*) > 10;"),
    ("SQL", "SELECT name FROM employees\nWHERE salary > (SELECT AVG(salary) FROM employees);"),
    ("Bash", "for f in *.txt; do\n  echo \"$f: $(wc -l < \"$f\") lines\"\ndone"),
    ("Bash", "grep -r \"TODO\" src/ | wc -l"),
]

SNIPPET_TEMPLATES = [
    "Explain what this {lang} code does:\n\n```\n{code}\n```",
    "Walk me through this {lang} snippet line by line:\n\n```\n{code}\n```",
    "What is the output or effect of this {lang} code? Explain briefly.\n\n```\n{code}\n```",
    "Describe in two sentences what this code does:\n\n```\n{code}\n```",
    "Is there anything surprising or risky about this {lang} code?\n\n```\n{code}\n```",
]

# (language, intended behaviour, buggy code, observed symptom)
BUGS = [
    ("Python", "return the largest number in a list",
     "def biggest(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best",
     "it returns 0 for a list of negative numbers"),
    ("Python", "sum the numbers from 1 to n",
     "def total(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s", "total(3) returns 3, not 6"),
    ("Python", "count the words in a sentence", "def count_words(s):\n    return len(s.split(' '))",
     "it gives the wrong count when there are double spaces"),
    ("Python", "average a list of numbers", "def avg(xs):\n    return sum(xs) / len(xs)",
     "it crashes on an empty list"),
    ("Python", "return a new list with each item doubled",
     "def double(xs):\n    for i in range(len(xs)):\n        xs[i] *= 2", "it returns None and edits my list"),
    ("Python", "check whether a key is in a dictionary", "def has(d, k):\n    return k in d.values()",
     "it says False for keys that exist"),
    ("Python", "read a number from the user and add 10", "n = input('Number: ')\nprint(n + 10)",
     "it raises a TypeError"),
    ("Python", "print the numbers 1 to 5", "i = 1\nwhile i < 5:\n    print(i)\n    i += 1", "it stops at 4"),
    ("JavaScript", "check whether a value is the number 5", "function isFive(x) {\n  return x == 5;\n}",
     "isFive('5') returns true"),
    ("JavaScript", "return the last item of an array", "function last(arr) {\n  return arr[arr.length];\n}",
     "it always returns undefined"),
    ("JavaScript", "sort numbers in ascending order", "const sorted = [10, 9, 1, 2].sort();",
     "the result is [1, 10, 2, 9]"),
    ("JavaScript", "add up the prices in a cart", "let total;\nfor (const p of prices) {\n  total += p;\n}",
     "total comes out as NaN"),
    ("SQL", "find customers with no email", "SELECT * FROM customers WHERE email = NULL;", "it returns no rows"),
    ("Bash", "print each file name in the folder", "for f in $(ls); do echo $f; done",
     "file names with spaces get split"),
]

BUG_TEMPLATES = [
    "This {lang} code should {goal}, but {symptom}. Can you fix it?\n\n```\n{code}\n```",
    "Find the bug: the code below is meant to {goal}, yet {symptom}.\n\n```\n{code}\n```",
    "Why does this {lang} code fail? It should {goal}, but {symptom}.\n\n```\n{code}\n```",
    "Fix this {lang} snippet so it correctly does this: {goal}. Explain the fix in one sentence.\n\n```\n{code}\n```",
]

# (table description, what the query should return)
SQL_TASKS = [
    ("orders(id, customer_id, total, created_at)", "returns the 5 largest orders"),
    ("orders(id, customer_id, total, created_at)", "returns the total revenue per customer"),
    ("orders(id, customer_id, total, created_at)", "counts orders placed in 2024"),
    ("employees(id, name, department, salary)", "lists the highest-paid employee in each department"),
    ("employees(id, name, department, salary)", "returns the average salary per department, highest first"),
    ("employees(id, name, department, salary)", "finds employees whose name starts with 'A'"),
    ("products(id, name, price, stock)", "lists products that are out of stock"),
    ("products(id, name, price, stock)", "raises every price by 10 percent"),
    ("students(id, name, grade) and scores(student_id, subject, score)", "shows each student's average score"),
    ("students(id, name, grade) and scores(student_id, subject, score)", "lists students who have no scores yet"),
    ("books(id, title, author, year)", "counts books per author, only authors with more than 3 books"),
    ("books(id, title, author, year)", "finds the oldest book"),
    ("users(id, email, signup_date)", "finds duplicate email addresses"),
    ("users(id, email, signup_date)", "counts sign-ups per month"),
]

SQL_TEMPLATES = [
    "Given a table {table}, write a SQL query that {task}.",
    "I have a SQL table {table}. How do I write a query that {task}?",
    "Write a SQL query that {task}. The table is {table}.",
]

SHELL_TASKS = [
    "find all files larger than 100 MB in my home folder", "count the lines in every .py file in a directory",
    "rename all .jpeg files in a folder to .jpg", "show the 10 biggest folders in the current directory",
    "find which process is using port 8080", "search all text files for the word 'error', ignoring case",
    "delete files older than 30 days in /tmp/logs", "make a compressed archive of a folder",
    "show the last 50 lines of a log file and keep following it", "replace 'foo' with 'bar' in every .txt file",
    "list the 5 most frequent IP addresses in an access log", "check how much disk space is free",
    "download a file with curl and save it under a new name", "print the current date in YYYY-MM-DD format",
    "remove duplicate lines from a file without changing their order", "copy a folder to a remote server",
]

SHELL_TEMPLATES = [
    "What shell command would {task}?", "Write a bash one-liner to {task}.",
    "How do I {task} from the Linux command line?", "Give me a shell command to {task}, and explain each part.",
]

# --- writing ------------------------------------------------------------------------------------------

WRITING_SUBJECTS = [
    "the first snow of winter", "a lighthouse keeper", "a rainy Monday morning", "an old bicycle",
    "a city at night", "a cat who wants to be a chef", "the ocean at dawn", "a forgotten library book",
    "a robot learning to paint", "autumn leaves", "a grandmother's kitchen", "a lost umbrella",
    "the moon", "a busy train station", "a small garden on a balcony", "a dragon afraid of heights",
    "the last day of summer", "a thunderstorm", "a coffee shop regular", "a paper boat",
    "a mountain hike", "an astronaut missing home", "a market in the morning", "a friendly ghost",
    "a snail in a hurry", "the smell of fresh bread", "a retired pirate", "a kite on a windy day",
]

WRITING_FORMS = [
    "Write a haiku about {s}.", "Could you write a four-line poem about {s}?", "I'd love a limerick about {s}.",
    "Start a short story about {s} with one strong opening paragraph.",
    "Tell a very short story (under 100 words) about {s}.", "Describe {s} in one vivid paragraph.",
    "Pretend you keep a diary and write today's entry about {s}.",
    "Begin a fairy tale about {s} in two sentences.", "Make up a short rhyming poem for kids about {s}.",
    "Give me a free-verse poem about {s}, no more than eight lines.",
    "As a news reporter, describe {s} in three sentences.", "Compose a short song chorus about {s}.",
]

WRITING_STYLES = ["", " Make it cheerful.", " Use simple words.", " Give it a surprising ending.",
                  " Make it a little sad.", " Make it funny.", " Write it in the present tense."]

PRODUCTS = [
    "a reusable water bottle", "noise-cancelling headphones", "a bamboo cutting board", "a solar phone charger",
    "a weekly meal-planning app", "a cozy wool blanket", "a kids' science kit", "a standing desk",
    "a plant-watering reminder gadget", "handmade soap", "a folding bike", "a language-learning app",
]
PRODUCT_TEMPLATES = [
    "Write a short product description for {x}.", "Come up with a catchy two-line ad for {x}.",
    "Sell me {x} in 3 bullet points.", "Give me a one-sentence tagline for {x}.",
    "Describe {x} for an online shop in about 50 words.",
]

BUSINESSES = [
    "a neighborhood bakery", "a dog-walking service", "a bike repair shop", "a small bookstore",
    "a vegan food truck", "a tutoring center", "a house-cleaning company", "a local farmers' market",
    "a yoga studio", "a computer repair shop",
]
BUSINESS_TEMPLATES = [
    "Suggest a catchy slogan for {x}.", "Draft a welcome message for the website of {x}.",
    "Create a short social media post announcing the opening of {x}.",
]

# (recipient, purpose)
EMAILS = [
    ("my manager", "asking for Friday off"), ("a teacher", "explaining my child will miss school tomorrow"),
    ("a landlord", "reporting a leaking sink"), ("a coworker", "thanking them for help on a project"),
    ("a customer", "apologizing for a late delivery"), ("my team", "moving our weekly meeting to Thursday"),
    ("a hiring manager", "following up after an interview"), ("a neighbor", "inviting them to a barbecue"),
    ("a client", "sending over the final invoice"), ("a friend", "catching up after a long time"),
]
EMAIL_TEMPLATES = [
    "Write a short, polite email to {r} {p}.", "Draft a friendly message to {r} {p}. Keep it under 80 words.",
    "Help me write a formal email to {r} {p}.",
]

OCCASIONS = [
    "my sister's wedding", "a coworker's retirement", "my parents' 30th anniversary",
    "a friend's graduation", "a team that just finished a big project", "my best friend's birthday",
]
OCCASION_TEMPLATES = [
    "I need a short toast for {x}.", "Write a heartfelt card message for {x}.",
    "Give me a funny two-sentence speech for {x}.",
]

# --- explanation --------------------------------------------------------------------------------------

CONCEPTS = [
    "photosynthesis", "gravity", "inflation", "compound interest", "the water cycle", "vaccines",
    "black holes", "tides", "rainbows", "the seasons", "supply and demand", "electricity",
    "magnets", "evolution", "plate tectonics", "the immune system", "machine learning", "encryption",
    "the internet", "DNS", "recursion", "a database index", "version control", "cloud computing",
    "the greenhouse effect", "volcanoes", "earthquakes", "the stock market", "a credit score",
    "taxes", "democracy", "the scientific method", "DNA", "cells", "the heart", "sleep",
    "memory in the brain", "sound waves", "light", "solar panels", "batteries", "a refrigerator",
    "airplane flight", "the moon's phases", "time zones", "GPS", "Wi-Fi", "a compiler",
    "an API", "a hash table", "big-O notation", "probability", "averages and medians",
    "interest rates", "recycling", "composting", "antibiotics", "caffeine", "the food chain",
    "erosion", "clouds", "lightning", "the speed of light", "atoms", "chemical reactions",
    "friction", "muscles", "the Roman Empire", "the printing press", "the Industrial Revolution",
    "opportunity cost", "a budget", "renewable energy", "nuclear power", "photosynthesis in algae",
]
CONCEPT_TEMPLATES = [
    "What is {x}?", "Explain {x} in simple terms.", "Explain {x} to a ten-year-old.",
    "How does {x} work? Answer in one paragraph.", "Give me a 3-bullet explanation of {x}.",
    "Explain {x} using an everyday analogy.", "What is the most important thing to know about {x}?",
]

# Pairs that beginners often mix up.
CONCEPT_PAIRS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "storage"), ("speed", "velocity"),
    ("a list", "a tuple in Python"), ("HTTP", "HTTPS"), ("mean", "median"), ("a debit card", "a credit card"),
    ("an alligator", "a crocodile"), ("mass", "weight"), ("a comet", "an asteroid"), ("stocks", "bonds"),
    ("a compiler", "an interpreter"), ("affect", "effect"), ("a simile", "a metaphor"), ("TCP", "UDP"),
    ("frontend", "backend"), ("a recession", "a depression"), ("a fruit", "a vegetable"), ("AC", "DC current"),
]
PAIR_TEMPLATES = [
    "What's the difference between {a} and {b}?", "Explain the difference between {a} and {b} in two sentences.",
    "How are {a} and {b} different, and how are they similar?",
]

WHY_QUESTIONS = [
    "Why is the sky blue?", "Why do cats purr?", "Why do we have leap years?", "Why does ice float?",
    "Why do onions make you cry?", "Why do leaves change color in autumn?", "Why is the ocean salty?",
    "Why do we yawn?", "Why does bread go stale?", "Why do planes leave white trails in the sky?",
    "Why does a spoon look bent in a glass of water?", "Why do we get goosebumps?",
    "Why do stars twinkle?", "Why do metal objects feel colder than wooden ones?", "Why do we dream?",
    "Why does popcorn pop?", "Why do birds fly south for the winter?", "Why are computers binary?",
]

# --- advice -------------------------------------------------------------------------------------------

GOALS = [
    "sleep better", "save money on groceries", "learn a new language as an adult", "prepare for a job interview",
    "start running", "stop procrastinating", "make friends in a new city", "keep houseplants alive",
    "eat more vegetables", "read more books", "get better at public speaking", "organize my closet",
    "learn to cook simple meals", "reduce screen time", "study for exams more effectively", "negotiate a raise",
    "stay focused while working from home", "build an emergency fund", "write a good resume",
    "learn to play guitar", "wake up earlier", "drink more water", "manage stress at work",
    "plan a budget trip", "keep a journal", "improve my handwriting", "learn to code",
    "declutter my apartment", "be a better listener", "start a small vegetable garden",
]

SITUATIONS = [
    "feel nervous before every presentation", "keep forgetting my friends' birthdays",
    "have too many tabs open and can't focus", "am moving to a new city next month",
    "have a coworker who keeps interrupting me", "spend too much on takeout",
    "can't decide between two job offers", "feel tired every afternoon", "just adopted my first dog",
    "have a big exam in two weeks", "want to ask my boss for feedback", "have a roommate who never cleans",
    "am starting my first job next week", "lose motivation halfway through projects",
    "want to get back in touch with an old friend", "am hosting dinner for eight people for the first time",
]

ADVICE_TEMPLATES = [
    "How can I {x}?", "Give me 5 practical tips to {x}.", "I want to {x}. Where should I start?",
    "What is the single most useful thing I can do to {x}?", "My friend wants to {x}. What should I tell them?",
    "What are common mistakes people make when they try to {x}?", "Make me a simple one-week plan to {x}.",
    "In 3 bullet points, how do I {x}?",
]

SITUATION_TEMPLATES = [
    "I {x}. What should I do?", "Any advice? I {x}.", "I {x}. Give me three concrete suggestions.",
    "What would you recommend if I {x}? Keep it short.",
]

# --- chat ---------------------------------------------------------------------------------------------

SMALL_TALK = [
    "Hi! How's it going?", "Good morning! Any tips for a productive day?", "Hey, can you keep me company for a bit?",
    "What's something that made you smile today?", "Hello there! What can you help me with?",
    "I'm having a slow afternoon. Say something cheerful!", "Do you ever get bored?",
    "What would you do on a perfect Saturday?", "Thanks for the help earlier!", "Can we just chat for a minute?",
    "Tell me something interesting.", "What's a good question to start a conversation?",
    "I had a long day. How was yours?", "Good night! Any last thoughts before I sleep?",
    "Say hi to me like a pirate.", "Guess what? I finished my first marathon!",
    "What's your name?", "Can you introduce yourself in two sentences?",
    "Let's play 20 questions. I'm thinking of an animal.", "Give me a riddle to solve.",
]

JOKE_TOPICS = [
    "cats", "programmers", "coffee", "the moon", "math teachers", "penguins", "vegetables", "Mondays",
    "dinosaurs", "pizza", "robots", "the weather", "dogs", "books", "bicycles", "cheese",
]
JOKE_TEMPLATES = ["Tell me a joke about {x}.", "Do you know any good jokes about {x}?",
                  "Make me laugh with a pun about {x}."]

FAVORITES = [
    "season", "kind of weather", "board game", "fruit", "color", "holiday", "animal", "word",
    "time of day", "dessert", "type of music", "planet",
]
FAVORITE_TEMPLATES = ["What's your favorite {x}, and why?", "If you had to pick a favorite {x}, what would it be?"]

EVENTS = [
    "adopted a kitten", "started a new job", "moved into my first apartment", "learned to juggle",
    "baked my first loaf of bread", "finished reading a really long book", "got a new bike",
    "planted tomatoes on my balcony", "passed my driving test", "started learning the piano",
    "ran my first 5K", "painted my bedroom blue",
]

EVENT_FOLLOWUPS = ["", " What do you think?", " What should I do next?", " Any tips?",
                   " Isn't that exciting?", " Tell me something encouraging."]

WOULD_YOU_RATHER = [
    ("live by the sea", "live in the mountains"), ("be able to fly", "be invisible"),
    ("have a pet dragon", "have a pet unicorn"), ("only eat pizza", "only eat tacos"),
    ("travel to the past", "travel to the future"), ("read minds", "talk to animals"),
    ("never be cold", "never be hot"), ("live without music", "live without movies"),
]
RATHER_TEMPLATES = ["Would you rather {a} or {b}?", "Quick game: {a} or {b}? Pick one and tell me why."]

FUN_FACT_TOPICS = [
    "octopuses", "honey", "the Eiffel Tower", "bananas", "sharks", "the human brain", "Saturn", "ants",
    "volcanoes", "owls", "chocolate", "the Pacific Ocean", "elephants", "snowflakes", "trees", "frogs",
]
FACT_TEMPLATES = ["Tell me a fun fact about {x}.", "What's something most people don't know about {x}?"]

RECOMMEND = [
    ("book", "space"), ("movie", "friendship"), ("podcast", "history"), ("board game", "pirates"),
    ("book", "cooking"), ("movie", "time travel"), ("song", "the sea"), ("documentary", "volcanoes"),
    ("book", "learning to draw"), ("podcast", "money"),
]
RECOMMEND_TEMPLATES = ["Can you recommend a {m} about {x}?", "I'd like a good {m}, ideally something about {x}. Ideas?"]

OPINIONS = [
    "pineapple on pizza", "working from home", "reading on paper versus e-readers", "cats versus dogs",
    "breakfast for dinner", "summer versus winter", "long walks", "learning to cook", "board games",
    "waking up early", "road trips", "handwritten letters",
]
OPINION_TEMPLATES = ["What do you think about {x}?", "Be honest: {x}, yes or no?"]
