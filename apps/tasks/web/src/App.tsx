import { useClientState, useComputed } from "@coherent/client/react";
import { createContext, useContext, useEffect, useState, useSyncExternalStore } from "react";

import { addTask, client, logIn, logOut, ok, refreshSession, rename, session, setStatus } from "./api";
import type { Status, Task } from "./generated/tasks";

const COLUMNS: { status: Status; title: string }[] = [
  { status: "todo", title: "To do" },
  { status: "in_progress", title: "In progress" },
  { status: "done", title: "Done" },
  { status: "cancelled", title: "Cancelled" },
];

const PAGE = 12;

/** Whether this page may write (someone is logged in). */
const CanWrite = createContext(false);

export function App() {
  const params = new URLSearchParams(location.search);
  const user = useSyncExternalStore(session.subscribe, session.current);
  useEffect(() => void refreshSession(), []);
  const projects = useComputed(() => ok(client.replica("TasksService.projects").value));
  const [chosen, setChosen] = useState(params.get("project"));
  const project = chosen ?? projects?.[0]?.id ?? null;
  return (
    <div className="app">
      <header>
        <h1>Tasks</h1>
        <select
          aria-label="project"
          value={project ?? ""}
          onChange={(e) => {
            setChosen(e.target.value);
            history.replaceState(null, "", `?project=${e.target.value}`);
          }}
        >
          {(projects ?? []).map((p) => (
            <option key={p.id} value={p.id}>
              {p.name}
            </option>
          ))}
        </select>
        <Connection />
        <Account user={user} />
      </header>
      <CanWrite.Provider value={user !== null}>
        {project ? <Board project={project} /> : <p className="empty">No project yet: run `tasks seed`.</p>}
      </CanWrite.Provider>
      <footer>
        Each column is a replica of <code>TasksService.page</code>, each count one of{" "}
        <code>TasksService.summary</code>, held over a WebSocket: a change made anywhere (another tab, curl, a Rust
        client) reaches this page as an invalidation.
      </footer>
    </div>
  );
}

function Connection() {
  const state = useClientState(client);
  const label =
    state === "live" ? "live" : state === "reconnecting" || state === "connecting" ? "reconnecting…" : state;
  return (
    <span className={`connection ${state}`} data-testid="connection" data-state={state} title={client.lastError?.message}>
      <span className="dot" /> {label}
    </span>
  );
}

/** Who is logged in and a way out, or a way in. */
function Account({ user }: { user: string | null }) {
  const [name, setName] = useState("");
  const [password, setPassword] = useState("");
  const [error, setError] = useState<string | null>(null);
  if (user !== null) {
    return (
      <span className="account" data-testid="account" data-user={user}>
        {user} <button onClick={() => void logOut()}>Log out</button>
      </span>
    );
  }
  return (
    <form
      className="account"
      data-testid="account"
      onSubmit={(e) => {
        e.preventDefault();
        logIn(name, password).then(
          () => {
            setPassword("");
            setError(null);
          },
          (err: Error) => setError(err.message),
        );
      }}
    >
      <input aria-label="user" placeholder="user" value={name} onChange={(e) => setName(e.target.value)} />
      <input
        aria-label="password"
        type="password"
        placeholder="password"
        value={password}
        onChange={(e) => setPassword(e.target.value)}
      />
      <button type="submit">Log in</button>
      {error ? <span className="error">{error}</span> : null}
    </form>
  );
}

function Board({ project }: { project: string }) {
  const canWrite = useContext(CanWrite);
  const summary = useComputed(() => ok(client.replica("TasksService.summary", project).value), [project]);
  const [title, setTitle] = useState("");
  return (
    <main>
      <form
        className="new"
        onSubmit={(e) => {
          e.preventDefault();
          if (title.trim()) void addTask(project, title.trim()).then(() => setTitle(""));
        }}
      >
        <input
          aria-label="new task"
          placeholder={canWrite ? "A new task…" : "Log in to add tasks"}
          disabled={!canWrite}
          value={title}
          onChange={(e) => setTitle(e.target.value)}
        />
        <button type="submit" disabled={!canWrite}>
          Add
        </button>
        <span className="total" data-testid="total">
          {summary ? `${summary.total} tasks` : ""}
        </span>
      </form>
      <div className="board">
        {COLUMNS.map((c, i) => (
          <Column key={c.status} project={project} index={i} count={summary?.[c.status]} {...c} />
        ))}
      </div>
    </main>
  );
}

function Column(props: { project: string; status: Status; title: string; index: number; count: number | undefined }) {
  const { project, status, index } = props;
  const page = useComputed(
    () => ok(client.replica("TasksService.page", { project, status, limit: PAGE, after: null }).value),
    [project, status],
  );
  return (
    <section className="column" data-status={status}>
      <h2>
        {props.title} <span className="count">{props.count ?? ""}</span>
      </h2>
      {page === undefined ? (
        <p className="loading">loading…</p>
      ) : (
        page.items.map((t) => <Card key={t.id} task={t} index={index} />)
      )}
    </section>
  );
}

function Card({ task, index }: { task: Task; index: number }) {
  const canWrite = useContext(CanWrite);
  const move = (by: number) => {
    const to = COLUMNS[index + by];
    if (to) void setStatus(task, to.status);
  };
  return (
    <article className={`card ${task.priority}`} data-task={task.id}>
      <div
        className="title"
        onDoubleClick={() => {
          if (!canWrite) return;
          const title = prompt("Title", task.title);
          if (title) void rename(task, title);
        }}
      >
        {task.title}
      </div>
      <div className="meta">
        <span className="priority">{task.priority}</span>
        {task.assignee ? <span className="assignee">@{task.assignee}</span> : null}
      </div>
      <div className="moves">
        <button aria-label="move left" disabled={!canWrite || index === 0} onClick={() => move(-1)}>
          ◀
        </button>
        <button
          aria-label="move right"
          disabled={!canWrite || index === COLUMNS.length - 1}
          onClick={() => move(1)}
        >
          ▶
        </button>
      </div>
    </article>
  );
}
