"""The built-in distillation prompt set: varied requests of the four task types the bench measures,
built from templates and, for rewriting, from paragraphs of the Python standard library's own
docstrings (local text). None of them is a starter prompt: those stay held out for evaluation."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

from specsplit.errors import UsageError

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "SQL", "Bash", "Go", "Rust", "Java", "C"]
CODE_TASKS = [
    "reverses a linked list", "merges two sorted lists", "counts the words in a text file",
    "computes the nth Fibonacci number iteratively", "checks whether a number is prime",
    "flattens a nested list", "removes duplicates from a list while keeping the order",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "validates an email address with a regular expression", "implements binary search",
    "implements bubble sort", "implements quicksort", "returns the factorial of a number recursively",
    "parses a date string in ISO format", "groups a list of dictionaries by a key",
    "computes the average of a list of numbers, ignoring None values", "transposes a matrix",
    "checks whether two strings are anagrams", "counts the vowels in a string",
    "returns the most common element of a list", "capitalizes the first letter of every word",
    "implements a queue with two stacks", "computes the greatest common divisor of two numbers",
    "generates all permutations of a string", "chunks a list into pieces of size n",
    "converts Celsius to Fahrenheit", "reads a JSON file and prints its keys",
    "sends an HTTP GET request and returns the status code", "retries a function up to three times",
    "measures how long a function takes", "implements a simple LRU cache",
    "returns the second largest number in a list", "checks whether a year is a leap year",
    "merges two dictionaries", "validates that parentheses in a string are balanced",
    "computes the sum of the digits of a number", "finds all files with a given extension in a directory",
    "converts a list of tuples into a dictionary", "computes the dot product of two vectors",
    "implements a binary search tree with insert and search", "rotates a list by k positions",
    "converts a decimal number to binary", "counts the lines in a file", "shuffles a list in place",
    "returns the intersection of two lists", "implements depth-first search on a graph",
    "implements breadth-first search on a graph", "computes the median of a list",
    "writes a list of dictionaries to a CSV file", "splits a string into sentences",
]
SQL_TASKS = [
    "returns all employees hired after 2020, ordered by salary", "counts the orders per customer",
    "finds products that were never ordered", "returns the average price per category",
    "deletes duplicate rows from a table of emails", "joins orders with customers and shows the customer name",
    "creates a table for blog posts with an id, title, body and created_at column",
    "returns the top three departments by number of employees", "updates the stock of a product after a sale",
    "finds customers who placed more than five orders in 2023",
]
CODE_FORMS = ["Write a {lang} function that {task}.", "Write {lang} code that {task}, with comments.",
              "Implement a {lang} function that {task}. Include an example of how to call it.",
              "Show me how to write a {lang} function that {task}."]
CODE_EXTRA = [
    "Write a Python class BankAccount with deposit, withdraw and balance methods.",
    "Write a Python class Rectangle with area and perimeter methods.",
    "Write a Python dataclass for a Point with x and y and a method for the distance to another point.",
    "Write a Python unittest test case for a function add(a, b).",
    "Write a pytest test for a function that reverses a string.",
    "Write a Dockerfile for a Python web application that uses Flask.",
    "Write a Makefile with build, test and clean targets for a C project.",
    "Write an HTML page with a form that has a name field, an email field and a submit button.",
    "Write CSS that centers a div horizontally and vertically.",
    "Write a Python script that prints the numbers from 1 to 100, replacing multiples of 3 with Fizz "
    "and of 5 with Buzz.",
    "Write a JavaScript class TodoList with add, remove and list methods.",
    "Write a Python generator that yields the lines of a file without the trailing newline.",
    "Write a Flask route that returns a JSON list of users.",
    "Write a Python context manager that times a block of code.",
    "Write a Python decorator that logs the arguments of a function call.",
    "Write a regular expression that matches a US phone number and explain it.",
    "Write a bash script that backs up a directory into a tar.gz file named with today's date.",
    "Write a Go struct for a User with a method that returns the full name.",
]
FORMATS = [
    ("JSON object", "Return a JSON object describing {subject} with the fields {fields}."),
    ("JSON object", "Give me a JSON object for {subject} with these keys: {fields}."),
    ("JSON array", "Return a JSON array of three {plural}, each with the fields {fields}."),
    ("YAML", "Write a YAML document describing {subject} with {fields}."),
    ("markdown table", "Make a markdown table of three {plural} with the columns {fields}."),
    ("CSV", "Write CSV data with a header row for four {plural} with the columns {fields}."),
    ("XML", "Write an XML document describing {subject} with the elements {fields}."),
    ("TOML", "Write a TOML configuration for {subject} with {fields}."),
]
SUBJECTS = [
    ("a movie", "movies", "title, director, year and rating"),
    ("a person", "people", "name, age, email and city"),
    ("a product", "products", "name, price, currency and in_stock"),
    ("a city", "cities", "name, country, population and area"),
    ("a car", "cars", "make, model, year and color"),
    ("a recipe", "recipes", "name, servings, ingredients and steps"),
    ("a student", "students", "name, id, grade and courses"),
    ("a song", "songs", "title, artist, album and duration"),
    ("a laptop", "laptops", "brand, cpu, ram_gb and price"),
    ("a restaurant", "restaurants", "name, cuisine, rating and address"),
    ("an employee", "employees", "name, department, salary and start_date"),
    ("a flight", "flights", "number, origin, destination and departure"),
    ("a database connection", "database connections", "host, port, user and database"),
    ("a server", "servers", "hostname, ip, os and memory_gb"),
    ("a country", "countries", "name, capital, currency and language"),
    ("an animal", "animals", "name, species, habitat and diet"),
    ("a game", "games", "title, platform, genre and release_year"),
    ("a user account", "user accounts", "username, email, created_at and is_admin"),
    ("an order", "orders", "id, customer, items and total"),
    ("a planet", "planets", "name, diameter_km, moons and has_rings"),
    ("a logging setup", "loggers", "level, format, file and rotation"),
    ("an event", "events", "name, date, location and attendees"),
    ("a task", "tasks", "title, priority, due_date and done"),
    ("a hotel", "hotels", "name, stars, city and price_per_night"),
]
REWRITES = [
    "Rewrite the following text in simpler words:", "Rewrite the following text more formally:",
    "Summarize the following text in one sentence:", "Rewrite the following text as a bulleted list:",
    "Fix any grammar mistakes and rewrite the following text clearly:", "Paraphrase the following text:",
    "Rewrite the following text so that a ten-year-old can understand it:", "Make the following text shorter:",
]
OPEN_FORMS = ["Explain {t} in simple terms.", "What are the main advantages and disadvantages of {t}?",
              "Give three tips about {t}.", "Write a short paragraph about {t}.", "Why is {t} important?",
              "Describe {t} to a beginner.", "What are common mistakes people make with {t}?"]
TOPICS = [
    "photosynthesis", "the water cycle", "machine learning", "compound interest", "climate change", "the internet",
    "exercise", "sleep", "learning a new language", "time management", "renewable energy", "the solar system",
    "public speaking", "healthy eating", "saving money", "version control", "cloud computing", "recycling",
    "the human heart", "volcanoes", "electric cars", "meditation", "remote work", "cybersecurity", "gardening",
    "the French Revolution", "democracy", "vaccines", "black holes", "inflation", "open source software",
    "writing a resume", "job interviews", "teamwork", "reading books", "travelling on a budget", "coffee",
    "the printing press", "earthquakes", "artificial intelligence", "bees", "the moon", "chess", "music practice",
    "password security", "databases", "unit testing", "the stock market", "forests", "the ocean",
]


def _docstring_paragraphs(limit: int, rng: random.Random) -> list[str]:
    import collections
    import csv
    import datetime
    import email
    import functools
    import itertools
    import json as json_mod
    import logging
    import os
    import pathlib
    import re
    import shutil
    import statistics
    import string
    import textwrap
    import threading
    import urllib.parse

    paragraphs = set()
    for module in (collections, csv, datetime, email, functools, itertools, json_mod, logging, os, pathlib, re,
                   shutil, statistics, string, textwrap, threading, urllib.parse):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if 120 <= len(para) <= 500 and ">>>" not in para and "::" not in para:
                    paragraphs.add(para)
    paragraphs = sorted(paragraphs)
    rng.shuffle(paragraphs)
    return paragraphs[:limit]


def builtin_prompts(seed: int = 0) -> list[dict]:
    """About 1200 prompts, interleaved by task type so that any prefix of the list is balanced."""
    rng = random.Random(seed)
    code = [form.format(lang=lang, task=task) for task in CODE_TASKS
            for lang, form in zip(rng.sample(LANGUAGES[3:], 3) + ["Python", "Python"], rng.sample(CODE_FORMS * 2, 5))]
    code += [f"Write a SQL query that {t}." for t in SQL_TASKS] + CODE_EXTRA
    code += [f"{p} Keep it short." for p in rng.sample(code, 60)]
    structured = [form.format(subject=s, plural=p, fields=f) for s, p, f in SUBJECTS
                  for _, form in FORMATS]
    rewrite = [f"{rng.choice(REWRITES)}\n\n{para}" for para in _docstring_paragraphs(400, rng)]
    open_ = [form.format(t=t) for t in TOPICS for form in rng.sample(OPEN_FORMS, 5)]
    pools = {"code": code, "structured": structured, "rewrite": rewrite, "open": open_}
    for name, pool in pools.items():
        pools[name] = list(dict.fromkeys(pool))
        rng.shuffle(pools[name])
    out, i = [], 0
    while any(i < len(p) for p in pools.values()):
        out += [{"task_type": t, "prompt": p[i]} for t, p in pools.items() if i < len(p)]
        i += 1
    return out


# How the target's own user turns begin: requests of every kind its users send (code, structured
# output, rewrites, questions, translation, advice), each continued by the target itself.
OPENERS = ["Write", "Write a Python", "Write a function", "How do I", "How can I", "What is", "What are", "Explain",
           "Can you", "Create", "List", "Summarize", "Translate", "Give me", "Why", "I", "Please", "Generate",
           "Convert", "Describe", "Compare", "Help me", "Make a", "Rewrite", "Fix", "Tell me", "Suggest", "Is it",
           "Design", "Calculate"]


def target_written(lm, count: int, seed: int = 0, max_tokens: int = 64, log=print):
    """Up to `count` distinct user turns the target writes itself, yielded as each is accepted: its
    chat template up to a user's message, an opener, and the target's sampled continuation up to
    its end of turn (temperature 0.9, top 50, seeded). Turns cut by the budget, shorter than four
    words, or seen before are dropped. Any target with a chat template, no data set needed; they
    come out the way its own users' requests might, across the kinds the openers start. A target
    that rarely ends a turn gives fewer: at most 20 tries a prompt, and the log says how many it kept."""
    from tqdm import tqdm

    from specsplit.distill.gen import Sampler, decode_native

    tokenizer, rng = lm.tokenizer, random.Random(seed)
    mark = "\x00turn\x00"
    template = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    prefix = template[:template.index(mark)]
    eos, sampler = set(lm.eos_token_ids), Sampler(0.9, 50, seed)
    kept, seen, tries = 0, set(), 0
    bar = tqdm(total=count, desc="prompts the target writes", unit="prompt")
    while kept < count and tries < 20 * count:
        openers = [rng.choice(OPENERS) for _ in range(min(4 * (count - kept), 64, 20 * count - tries))]
        tries += len(openers)
        ids = [tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in openers]
        for i, cont in decode_native(lm, ids, max_tokens, sampler):
            if kept >= count:
                break
            if cont[-1] not in eos:
                continue
            text = (openers[i] + tokenizer.decode(cont[:-1])).strip()
            key = " ".join(text.lower().split())
            if len(text.split()) >= 4 and key not in seen:
                seen.add(key)
                kept += 1
                bar.update(1)
                yield {"task_type": "target-written", "prompt": text}
    bar.close()
    if kept < count:
        log(f"prompts: the target wrote {kept} of {count} usable user turns in {tries} tries")


def load_prompts(path: str | None, seeds: tuple[int, ...] = (0,)) -> list[dict]:
    """A JSONL file of {"prompt": ..., "task_type": ...} (task_type optional), or the built-in set:
    the prompts of each seed that the seeds before it did not have, appended in seed order (so the
    shards of a run with fewer seeds stay valid)."""
    if path is None:
        seen, out = set(), []
        for seed in seeds:
            for row in builtin_prompts(seed):
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    out.append(row)
        return out
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UsageError(f"{path}:{n}: each line needs an object with a string 'prompt'")
        rows.append({"task_type": str(row.get("task_type", "unknown")), "prompt": row["prompt"]})
    return rows
