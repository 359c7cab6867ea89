// PROVISIONAL: replaced by `cargo run -p coherent-tasks -- typescript`.
export type Priority = "low" | "medium" | "high" | "urgent";
export type Status = "todo" | "in_progress" | "done" | "cancelled";
export interface Task { id: string; project: string; title: string; description: string; priority: Priority; status: Status; assignee: string | null; created_at: number; updated_at: number }
export interface Project { id: string; name: string; created_at: number }
export interface Summary { project: string; total: number; todo: number; in_progress: number; done: number; cancelled: number }
export interface Page { items: Task[]; next: string | null }
export interface ListQuery { project: string | null; status: Status | null; limit: number; after: string | null }
export interface Invalid { field: string; message: string }
export type ApiError = { Invalid: Invalid } | { NotFound: string } | { Unknown: Invalid } | { TooLarge: null } | { Unavailable: string } | { Internal: string };
export interface TasksService {
  "TasksService.task": { args: [id: string]; result: { Ok: Task | null } | { Err: ApiError } };
  "TasksService.page": { args: [q: ListQuery]; result: { Ok: Page } | { Err: ApiError } };
  "TasksService.summary": { args: [project: string]; result: { Ok: Summary | null } | { Err: ApiError } };
  "TasksService.projects": { args: []; result: { Ok: Project[] } | { Err: ApiError } };
}
