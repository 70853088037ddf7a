"""The tuning run: short measured jobs choose the layout, correct the plan and hand off to the long run.

    candidates(recipe, n) -> [Candidate]       the planner's best layouts by predicted cost to finish the
                                               run, each predicted to fit, plus the recipe's own
    measure(lines, ...) -> Measurement         what one short job measured (steady state only)
    choose(candidates, measurements) -> Choice by projected cost to finish the run, noise stated
    Store                                      measurements per hardware and model shape, results per
                                               recipe, team and image (a JSON file)
    refit(recipe, hardware, store) -> Refit    the plan's step time and memory corrected by what was
                                               measured on that hardware (never across hardware)

Pure functions except `store` (one JSON file) and `local` (runs the trainer as a local process, as
the emulator's job would). docs/tuning.md explains the engine, the steps chosen and the rules. May
import `planner`, `recipes`, `protocol` and `errors`; the CLI drives the jobs.
"""
