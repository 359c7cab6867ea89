//! The model: tasks grouped in projects, what a client sends to create or change one, and
//! the validation every backend applies the same way.

use std::time::{SystemTime, UNIX_EPOCH};

use coherent::typescript::TS;
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// How urgent a task is. Stored as a small integer (its index here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Whenever.
    Low,
    /// The default.
    Medium,
    /// Soon.
    High,
    /// Now.
    Urgent,
}

/// Where a task stands. Stored as a small integer (its index here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Not started (the default).
    Todo,
    /// Being worked on.
    InProgress,
    /// Finished.
    Done,
    /// Dropped.
    Cancelled,
}

impl Priority {
    /// Every priority, in storage order.
    pub const ALL: [Priority; 4] = [Self::Low, Self::Medium, Self::High, Self::Urgent];

    /// The stored form.
    pub fn code(self) -> i16 {
        self as i16
    }

    /// From the stored form.
    pub fn from_code(code: i16) -> Option<Self> {
        Self::ALL.get(usize::try_from(code).ok()?).copied()
    }
}

impl Status {
    /// Every status, in storage order.
    pub const ALL: [Status; 4] = [Self::Todo, Self::InProgress, Self::Done, Self::Cancelled];

    /// The stored form.
    pub fn code(self) -> i16 {
        self as i16
    }

    /// From the stored form.
    pub fn from_code(code: i16) -> Option<Self> {
        Self::ALL.get(usize::try_from(code).ok()?).copied()
    }

    /// The name used in JSON and in query strings.
    pub fn name(self) -> &'static str {
        match self {
            Self::Todo => "todo",
            Self::InProgress => "in_progress",
            Self::Done => "done",
            Self::Cancelled => "cancelled",
        }
    }

    /// From the name used in JSON and in query strings.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// A task. Its id is a UUID v7, so ids sort by creation time: lists are ordered by id,
/// newest first, and paginated by the last id seen.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
pub struct Task {
    /// UUID v7, chosen by the server.
    pub id: Uuid,
    /// The project the task belongs to.
    pub project: Uuid,
    /// 1 to 200 characters.
    pub title: String,
    /// Up to 10,000 characters.
    pub description: String,
    /// How urgent it is.
    pub priority: Priority,
    /// Where it stands.
    pub status: Status,
    /// Who works on it, if anyone (1 to 100 characters).
    pub assignee: Option<String>,
    /// Microseconds since the Unix epoch.
    pub created_at: i64,
    /// Microseconds since the Unix epoch.
    pub updated_at: i64,
}

/// A project: a named group of tasks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
pub struct Project {
    /// UUID v7, chosen by the server.
    pub id: Uuid,
    /// 1 to 200 characters.
    pub name: String,
    /// Microseconds since the Unix epoch.
    pub created_at: i64,
}

/// How many tasks of a project stand where.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
pub struct Summary {
    /// The project.
    pub project: Uuid,
    /// All its tasks.
    pub total: u64,
    /// Tasks not started.
    pub todo: u64,
    /// Tasks being worked on.
    pub in_progress: u64,
    /// Tasks finished.
    pub done: u64,
    /// Tasks dropped.
    pub cancelled: u64,
}

impl Summary {
    /// A summary from the count of each status, in [`Status::ALL`] order.
    pub fn from_counts(project: Uuid, counts: [u64; 4]) -> Self {
        Self {
            project,
            total: counts.iter().sum(),
            todo: counts[0],
            in_progress: counts[1],
            done: counts[2],
            cancelled: counts[3],
        }
    }
}

/// One page of a list, newest first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, TS)]
#[ts(crate = "coherent::typescript")]
pub struct Page {
    /// At most the requested number of tasks.
    pub items: Vec<Task>,
    /// Pass as `after` to get the next page; absent on the last page.
    pub next: Option<Uuid>,
}

/// Which tasks a list shows: filters, the page size and where the page starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
#[ts(crate = "coherent::typescript")]
pub struct ListQuery {
    /// Only this project's tasks.
    pub project: Option<Uuid>,
    /// Only tasks with this status.
    pub status: Option<Status>,
    /// 1 to [`MAX_LIMIT`]; [`DEFAULT_LIMIT`] when not given.
    pub limit: u32,
    /// Only tasks older than this one (the previous page's `next`).
    pub after: Option<Uuid>,
}

impl ListQuery {
    /// Checks the page size: every path that lists (HTTP, RPC, the gateway, gRPC) reads
    /// through the store, which refuses a page over [`MAX_LIMIT`] with this.
    pub fn validate(&self) -> Result<(), Invalid> {
        if (1..=MAX_LIMIT).contains(&self.limit) {
            Ok(())
        } else {
            Err(Invalid::new("limit", format!("must be 1 to {MAX_LIMIT}")))
        }
    }
}

/// The page size when a list request names none.
pub const DEFAULT_LIMIT: u32 = 20;
/// The largest page a list request may ask for.
pub const MAX_LIMIT: u32 = 100;

/// The body of `POST /api/tasks`, and what the `tasks.create` command carries: the server
/// chooses the id and the times.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTask {
    /// The project the task belongs to (it must exist).
    pub project: Uuid,
    /// 1 to 200 characters, not all blank.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00]*[^\s\x00][^\x00]*$"
    )]
    pub title: String,
    /// Up to 10,000 characters (empty when absent).
    #[serde(default)]
    #[schema(max_length = 10000, pattern = r"^[^\x00]*$")]
    pub description: String,
    /// `medium` when absent.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// `todo` when absent.
    #[serde(default)]
    pub status: Option<Status>,
    /// Who works on it (1 to 100 characters), if anyone.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 100, pattern = r"^[^\x00]*$")]
    pub assignee: Option<String>,
}

/// The body of `PATCH /api/tasks/{id}`: the fields to change; absent fields stay.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskPatch {
    /// A new title (1 to 200 characters, not all blank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00]*[^\s\x00][^\x00]*$"
    )]
    pub title: Option<String>,
    /// A new description (up to 10,000 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 10000, pattern = r"^[^\x00]*$")]
    pub description: Option<String>,
    /// A new priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// A new status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    /// A new assignee, or `null` to clear it.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>, min_length = 1, max_length = 100, pattern = r"^[^\x00]*$")]
    pub assignee: Option<Option<String>>,
}

/// `"field": null` is `Some(None)` (clear it); an absent field is `None` (keep it).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// The body of `POST /api/projects`, and what the `tasks.create_project` command carries.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewProject {
    /// 1 to 200 characters, not all blank.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00]*[^\s\x00][^\x00]*$"
    )]
    pub name: String,
}

/// An input that breaks a rule: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, TS)]
#[ts(crate = "coherent::typescript")]
pub struct Invalid {
    /// The field, as named in the request (`title`, `limit`, ...).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl Invalid {
    /// An error naming `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

fn check_len(field: &str, value: &str, min: usize, max: usize) -> Result<(), Invalid> {
    let n = value.chars().count();
    if n < min || n > max {
        return Err(Invalid::new(
            field,
            format!("must be {min} to {max} characters, not {n}"),
        ));
    }
    // PostgreSQL's text cannot hold NUL; no field needs it.
    if value.contains('\0') {
        return Err(Invalid::new(field, "must not contain NUL characters"));
    }
    Ok(())
}

fn check_title(field: &str, title: &str) -> Result<(), Invalid> {
    check_len(field, title, 1, 200)?;
    // Blank: every character is white space, as Unicode (and Python's `\s`, which the
    // schema's pattern is checked with, also counting U+001C to U+001F) says.
    if title
        .chars()
        .all(|c| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
    {
        return Err(Invalid::new(field, "must not be blank"));
    }
    Ok(())
}

impl NewTask {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_title("title", &self.title)?;
        check_len("description", &self.description, 0, 10_000)?;
        if let Some(a) = &self.assignee {
            check_len("assignee", a, 1, 100)?;
        }
        Ok(())
    }

    /// The task this creates, with a fresh id, at `now` (µs), once every field passed
    /// [`validate`](Self::validate): the one way from a client's input to a task.
    pub fn into_task(self, now: i64) -> Result<Task, Invalid> {
        self.validate()?;
        Ok(Task {
            id: new_id(now),
            project: self.project,
            title: self.title,
            description: self.description,
            priority: self.priority.unwrap_or(Priority::Medium),
            status: self.status.unwrap_or(Status::Todo),
            assignee: self.assignee,
            created_at: now,
            updated_at: now,
        })
    }
}

impl TaskPatch {
    /// Checks every field given.
    pub fn validate(&self) -> Result<(), Invalid> {
        if let Some(t) = &self.title {
            check_title("title", t)?;
        }
        if let Some(d) = &self.description {
            check_len("description", d, 0, 10_000)?;
        }
        if let Some(Some(a)) = &self.assignee {
            check_len("assignee", a, 1, 100)?;
        }
        Ok(())
    }

    /// Whether it changes which lists and counts the task is in.
    pub fn moves(&self) -> bool {
        self.status.is_some()
    }

    /// `task` with this patch applied at `now` (µs).
    pub fn apply(&self, task: &mut Task, now: i64) {
        if let Some(t) = &self.title {
            task.title.clone_from(t);
        }
        if let Some(d) = &self.description {
            task.description.clone_from(d);
        }
        if let Some(p) = self.priority {
            task.priority = p;
        }
        if let Some(s) = self.status {
            task.status = s;
        }
        if let Some(a) = &self.assignee {
            task.assignee.clone_from(a);
        }
        task.updated_at = now;
    }
}

impl NewProject {
    /// Checks the name.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_title("name", &self.name)
    }

    /// The project this creates, with a fresh id, at `now` (µs), once its name passed
    /// [`validate`](Self::validate).
    pub fn into_project(self, now: i64) -> Result<Project, Invalid> {
        self.validate()?;
        Ok(Project {
            id: new_id(now),
            name: self.name,
            created_at: now,
        })
    }
}

/// Microseconds since the Unix epoch.
pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A UUID v7 for `now` (µs): its time prefix orders ids by creation, and its random tail
/// keeps ids made in the same millisecond apart.
pub fn new_id(now: i64) -> Uuid {
    let now = u64::try_from(now).unwrap_or(0);
    let ts = uuid::Timestamp::from_unix(
        uuid::NoContext,
        now / 1_000_000,
        u32::try_from((now % 1_000_000) * 1_000).unwrap_or(0),
    );
    Uuid::new_v7(ts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for p in Priority::ALL {
            assert_eq!(Priority::from_code(p.code()), Some(p));
        }
        for s in Status::ALL {
            assert_eq!(Status::from_code(s.code()), Some(s));
            assert_eq!(Status::parse(s.name()), Some(s));
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.name())
            );
        }
        assert_eq!(Status::from_code(4), None);
        assert_eq!(Priority::from_code(-1), None);
    }

    #[test]
    fn ids_sort_by_time() {
        let a = new_id(1_700_000_000_000_000);
        let b = new_id(1_700_000_000_001_000);
        assert!(a < b);
        assert_eq!(a.get_version_num(), 7);
    }

    #[test]
    fn patch_tells_null_from_absent() {
        let p: TaskPatch = serde_json::from_str(r#"{"assignee":null}"#).unwrap();
        assert_eq!(p.assignee, Some(None));
        let p: TaskPatch = serde_json::from_str(r#"{}"#).unwrap();
        assert_eq!(p.assignee, None);
        assert!(serde_json::from_str::<TaskPatch>(r#"{"colour":1}"#).is_err());
    }

    #[test]
    fn validation_names_the_field() {
        let t = NewTask {
            project: Uuid::nil(),
            title: " ".into(),
            description: String::new(),
            priority: None,
            status: None,
            assignee: None,
        };
        assert_eq!(t.validate().unwrap_err().field, "title");
        let p = TaskPatch {
            assignee: Some(Some(String::new())),
            ..TaskPatch::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "assignee");
    }
}
