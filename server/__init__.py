"""pdserve daemons: model runner, scheduler, engine loop, OpenAI API, router and launcher."""
